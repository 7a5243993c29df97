"""Post-training stages built on TRL."""
