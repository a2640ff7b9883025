    ### BEGIN SOLUTION
    # Wrong: each rank returns its own time, not the average over the ranks.
    for _ in range(warmup):
        launch().wait()
    dist.barrier()
    t0 = time.perf_counter()
    works = [launch() for _ in range(iters)]
    for work in works:
        work.wait()
    return (time.perf_counter() - t0) / iters
    ### END SOLUTION
