    ### BEGIN SOLUTION
    # Wrong: the reduce-scatter copies the incoming chunk over the rank's own instead of adding it.
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    if n == 1:
        return
    right, left = (rank + 1) % n, (rank - 1) % n
    chunks = tensor.view(-1).tensor_split(n)
    for phase in range(2):
        for step in range(n - 1):
            if phase == 0:
                send, recv = chunks[(rank - step) % n], chunks[(rank - step - 1) % n]
            else:
                send, recv = chunks[(rank + 1 - step) % n], chunks[(rank - step) % n]
            for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, right, group),
                                                dist.P2POp(dist.irecv, recv, left, group)]):
                work.wait()
    ### END SOLUTION
