    ### BEGIN SOLUTION
    # Wrong: chunk(n) can make fewer than n chunks (7 elements on 5 ranks: 2, 2, 2, 1, only four; 6 on 4:
    # 2, 2, 2), so some rank indexes a chunk that is not there.
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    if n == 1:
        return
    right, left = (rank + 1) % n, (rank - 1) % n
    chunks = tensor.view(-1).chunk(n)
    inbox = torch.empty_like(chunks[0])
    for step in range(n - 1):
        send, recv = chunks[(rank - step) % n], chunks[(rank - step - 1) % n]
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
