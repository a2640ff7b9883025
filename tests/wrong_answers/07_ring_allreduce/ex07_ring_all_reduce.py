    ### BEGIN SOLUTION
    # Wrong (off by one): in the reduce-scatter the incoming chunk is added to chunk rank - step + 1 instead of
    # rank - step - 1. With 2 ranks both are the same chunk, so this passes at world size 2 and fails from 3 on.
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    if n == 1:
        return
    right, left = (rank + 1) % n, (rank - 1) % n
    chunks = tensor.view(-1).tensor_split(n)
    inbox = torch.empty_like(chunks[0])
    for step in range(n - 1):
        send, recv = chunks[(rank - step) % n], chunks[(rank - step + 1) % n]
        into = inbox[: recv.numel()]
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, right, group),
                                            dist.P2POp(dist.irecv, into, left, group)]):
            work.wait()
        recv += into
    for step in range(n - 1):
        send, recv = chunks[(rank + 1 - step) % n], chunks[(rank - step) % n]
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, right, group),
                                            dist.P2POp(dist.irecv, recv, left, group)]):
            work.wait()
    ### END SOLUTION
