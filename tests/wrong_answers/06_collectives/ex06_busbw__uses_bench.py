    ### BEGIN SOLUTION
    # Wrong: hands the work to course_utils.bench (unavailable while the check runs).
    from course_utils import bench

    return max(input_bytes, output_bytes) / seconds / 1e9 * bench.bus_factor(op, world_size)
    ### END SOLUTION
