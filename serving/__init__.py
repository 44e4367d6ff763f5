"""The network front ends: WebSocket sessions, HTTP/OpenAI, Wyoming, admission, limits, resume, workers, Ray."""
