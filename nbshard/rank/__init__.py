"""What a person calls inside a rank: process groups, devices, sharded building, checkpoints."""
