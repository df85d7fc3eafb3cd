"""The gateway: Lifeline's OpenAI-compatible front door (async, no ORM)."""
