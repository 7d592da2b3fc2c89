"""The runtime all three training frameworks share: process launch (torchrun), process groups, the
watchdog and worker console and failure I/O (the rendezvous endpoint check is `core.endpoint`:
config validation calls it)."""
