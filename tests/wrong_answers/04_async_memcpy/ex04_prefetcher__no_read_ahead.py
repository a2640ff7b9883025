    ### BEGIN SOLUTION
    # Wrong: copies each batch only when it is asked for, so nothing is in flight while the caller computes.
    for batch in batches:
        yield batch.to(device, non_blocking=True)
    ### END SOLUTION
