"""Training core shared by every Mariana application: config, run directory, checkpoints, export, loop."""
