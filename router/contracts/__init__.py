"""The router's contracts with clients and other processes: the routing key, the ring, the prompt blocks."""
