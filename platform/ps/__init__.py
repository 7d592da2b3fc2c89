"""Parameter-server framework: sharded embedding tables on servers, asynchronous (or bounded-stale,
or bulk-synchronous) sparse pull/push from workers, a torchrun-launched master that restarts failures and
restores checkpoints, and per-worker counters. The sparse step, its row stores and row rules are
`mariana.platform.sparse`'s (the one-process step too); this package adds the servers and their clients.

- protocol.py: what an application supplies (its model, batches, settings, optional key map);
- pull.py: `RemoteRows` (the row store on the servers) and the workers' `train_step`;
  worker_step.py: `PSWorkerStep`, its `PullAheadLoader` and `ServerCheckpointer`;
- server.py (`ParamServer`, served through transport.py), worker.py (`PSClient`), shard.py, dense.py;
- job.py: process start-up, serving, `assemble_model`, `Coordinator` (announcements of one worker to all, e.g.
  a stream's files); master.py, runtime.py: launching and transport set-up; transport.py: calls over ZeroMQ."""
