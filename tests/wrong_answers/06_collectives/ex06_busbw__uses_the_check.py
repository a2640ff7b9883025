    ### BEGIN SOLUTION
    # Wrong: hands the work to the check's own model.
    from course_utils.checks import collectives

    return collectives.model_busbw(op, input_bytes, output_bytes, seconds, world_size)
    ### END SOLUTION
