"""Status values with the badge colour each shows in the console."""

from django.db import models


class NodeState(models.TextChoices):
    """Node lifecycle (source document 004): JOIN -> SERVING -> DOWN -> LEFT."""

    JOIN = "join", "Joining"
    SERVING = "serving", "Serving"
    DOWN = "down", "Down"
    LEFT = "left", "Left"


NODE_STATE_BADGE = {
    NodeState.JOIN: "blue",
    NodeState.SERVING: "green",
    NodeState.DOWN: "red",
    NodeState.LEFT: "grey",
}


class Tier(models.TextChoices):
    """Priority tiers of gateway API keys; shedding starts at the bottom."""

    PREMIUM = "premium", "Premium"
    STANDARD = "standard", "Standard"
    BEST_EFFORT = "best_effort", "Best effort"
