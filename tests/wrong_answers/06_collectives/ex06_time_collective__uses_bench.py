    ### BEGIN SOLUTION
    # Wrong: hands the measuring to course_utils.bench (unavailable while the check runs).
    from course_utils import bench

    return bench.measure_collective("all_reduce", 1 << 20, warmup=warmup, iters=iters).time_ms / 1e3
    ### END SOLUTION
