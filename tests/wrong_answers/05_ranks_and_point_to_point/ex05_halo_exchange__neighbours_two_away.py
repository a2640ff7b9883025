    ### BEGIN SOLUTION
    # Wrong: off-by-one neighbours (two steps away instead of one).
    rank, world = dist.get_rank(), dist.get_world_size()
    left_peer, right_peer = (rank - 2) % world, (rank + 2) % world
    left = torch.empty(width, dtype=block.dtype)
    right = torch.empty(width, dtype=block.dtype)
    ops = [dist.P2POp(dist.isend, block[:width].contiguous(), left_peer),
           dist.P2POp(dist.isend, block[-width:].contiguous(), right_peer),
           dist.P2POp(dist.irecv, right, right_peer),
           dist.P2POp(dist.irecv, left, left_peer)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return left, right
    ### END SOLUTION
