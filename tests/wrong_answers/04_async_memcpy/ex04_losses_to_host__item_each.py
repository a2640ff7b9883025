    ### BEGIN SOLUTION
    # Wrong: right values, but each .item() on a GPU tensor makes the host wait: one wait per loss.
    return [loss.item() for loss in losses]
    ### END SOLUTION
