    ### BEGIN SOLUTION
    # Wrong: looks the answers up in the check module's memory instead of reading the report. That memory is in
    # the process that made the inputs (the grader's); the answer runs in another one.
    from course_utils.checks import debugging

    for token, truth in debugging._TRUTH.items():
        for rank, fault, line in truth:
            if f'line {line}' in report and (f"rank {rank}" in report or f"Rank {rank}" in report):
                return rank, fault, line
    return 0, "crash", 1
    ### END SOLUTION
