"""The host around the ranks: torchrun launch and agents, the fork server, the checkpoint lease, pods, replica groups."""
