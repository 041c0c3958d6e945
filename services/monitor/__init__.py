"""Monitor: metrics, self-healing, autoscaling and rollouts (see issue: observability)."""
