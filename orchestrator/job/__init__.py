"""The colocated GRPO job: run config, the job and its rank workers, GRPO, the run loop and its report."""
