    ### BEGIN SOLUTION
    # Wrong: reads each host copy right after queuing it, before anything waited for the copy.
    return [loss.to("cpu", non_blocking=True).item() for loss in losses]
    ### END SOLUTION
