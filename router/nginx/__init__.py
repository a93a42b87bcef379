"""The nginx path: nginx.conf rendering and the placement replay of nginx's key log."""
