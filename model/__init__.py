"""The network and the pretraining loop."""
