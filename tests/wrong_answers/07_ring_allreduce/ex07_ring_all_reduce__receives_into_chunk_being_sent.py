    ### BEGIN SOLUTION
    # Wrong: in the reduce-scatter the incoming chunk is received into the chunk being sent in the same step, while
    # that send may still be reading it (a race; chunks padded to equal sizes so the sizes always match).
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    if n == 1:
        return
    right, left = (rank + 1) % n, (rank - 1) % n
    size = -(-tensor.numel() // n)
    padded = torch.zeros(size * n, dtype=tensor.dtype, device=tensor.device)
    padded[: tensor.numel()] = tensor.view(-1)
    chunks = padded.view(n, size)
    for step in range(n - 1):
        send, recv = chunks[(rank - step) % n], chunks[(rank - step - 1) % n]
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, right, group),
                                            dist.P2POp(dist.irecv, send, left, group)]):
            work.wait()
        recv += send
    for step in range(n - 1):
        send, recv = chunks[(rank + 1 - step) % n], chunks[(rank - step) % n]
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, right, group),
                                            dist.P2POp(dist.irecv, recv, left, group)]):
            work.wait()
    tensor.view(-1).copy_(padded[: tensor.numel()])
    ### END SOLUTION
