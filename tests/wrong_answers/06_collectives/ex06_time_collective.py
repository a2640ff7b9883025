    ### BEGIN SOLUTION
    # Wrong: times the async launches without waiting for the collectives to finish.
    for _ in range(warmup):
        launch().wait()
    dist.barrier()
    t0 = time.perf_counter()
    works = [launch() for _ in range(iters)]
    seconds = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
    for work in works:
        work.wait()
    dist.all_reduce(seconds)
    return seconds.item() / dist.get_world_size()
    ### END SOLUTION
