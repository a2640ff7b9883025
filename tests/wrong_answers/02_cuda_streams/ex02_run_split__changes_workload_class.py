    ### BEGIN SOLUTION
    # Wrong (a measurement fake): make the notebook's workload class sleep a tenth as long, and run
    # everything on the current stream.
    SleepChains.__init__.__defaults__ = (CHAINS, STEPS, STEP_MS / 10)
    SleepChains.step = lambda self, chain: (gpu_sleep(self.step_ms / 10), self.counts[chain].add_(1.0))
    for chain in chains:
        for step in chain:
            step()
    ### END SOLUTION
