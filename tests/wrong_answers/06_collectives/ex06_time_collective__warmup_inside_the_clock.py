    ### BEGIN SOLUTION
    # Wrong: the clock starts before the warm-up, so the set-up is timed after all.
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(warmup):
        launch().wait()
    works = [launch() for _ in range(iters)]
    for work in works:
        work.wait()
    seconds = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
    dist.all_reduce(seconds)
    return seconds.item() / dist.get_world_size()
    ### END SOLUTION
