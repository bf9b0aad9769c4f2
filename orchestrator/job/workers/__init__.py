"""The job's processes and the driver's typed calls to them.

- `traced.Traced`: what every worker process shares: each call is a span `<role>.<method>`.
- `trainer_rank.TrainerRank`: one Megatron-core rank and its memory regions, in its process.
- `engine_replica.EngineReplica`: one transformers engine replica, in its process.
- `pool.WorkerPool`: the driver's bounded, typed calls to a set of workers, here or Ray actors
  (`pool.all(TrainerRank.stash, mode)`, never a method named by a string), naming the one at fault.
- `fanout`: the driver's view of them as the lifecycle's Protocols: `DistributedTrainer` (Trainer
  and MemoryRegions over every rank), `ReplicaSet` (one RolloutEngine over every replica) and the
  weight transports, chosen by `--weight-sync` through `WEIGHT_SYNCS`.
- `placement`: where they run: `LocalPlacement`, the driver's own process (one rank, on the
  device the process has); `RayPlacement`, Ray, the placement group (a bundle per GPU, shared by a
  rank and its replica), and the actors in it, each given its own environment.
- `staging`: the buffer a rank's weights cross to its replica by CUDA IPC.
- `payloads`: a rank's side of the SGLang push with one payload per TP rank (`PayloadSource`),
  each serialized from the rank's own memory; `fanout.PerTpRankPush` is the driver's.
"""
