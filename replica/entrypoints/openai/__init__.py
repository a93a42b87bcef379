"""The OpenAI front end: protocol models, serving, the HTTP plumbing both hosts share, the standalone server."""
