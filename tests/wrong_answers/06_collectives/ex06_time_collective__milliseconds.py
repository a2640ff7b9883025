    ### BEGIN SOLUTION
    # Wrong: milliseconds, not seconds.
    for _ in range(warmup):
        launch().wait()
    dist.barrier()
    t0 = time.perf_counter()
    works = [launch() for _ in range(iters)]
    for work in works:
        work.wait()
    seconds = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
    dist.all_reduce(seconds)
    return seconds.item() / dist.get_world_size() * 1e3
    ### END SOLUTION
