"""The runtime all three training frameworks share: process launch (torchrun), process groups, the
watchdog, worker console and failure I/O, and rendezvous endpoints."""
