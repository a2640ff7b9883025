    ### BEGIN SOLUTION
    # Wrong: the faulty loop unchanged: the rank with more batches waits in an all-reduce nobody joins.
    for x, y in batches:
        sgd_step(model, F.mse_loss(model(x), y), lr)
    return len(batches)
    ### END SOLUTION
