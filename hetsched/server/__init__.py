"""What every hetsched HTTP server shares: limits, the ASGI guard in front of the app, and how uvicorn runs it."""
