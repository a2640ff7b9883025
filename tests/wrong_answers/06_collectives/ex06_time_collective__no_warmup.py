    ### BEGIN SOLUTION
    # Wrong: no warm-up: the first call's set-up lands in the time (and only iters calls are made).
    dist.barrier()
    t0 = time.perf_counter()
    works = [launch() for _ in range(iters)]
    for work in works:
        work.wait()
    seconds = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
    dist.all_reduce(seconds)
    return seconds.item() / dist.get_world_size()
    ### END SOLUTION
