"""The API's routers, one small module per concern."""
