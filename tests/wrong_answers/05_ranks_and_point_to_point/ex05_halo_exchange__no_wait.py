    ### BEGIN SOLUTION
    # Wrong: returns the receive buffers without waiting for the receives.
    rank, world = dist.get_rank(), dist.get_world_size()
    left_peer, right_peer = (rank - 1) % world, (rank + 1) % world
    left = torch.zeros(width, dtype=block.dtype)
    right = torch.zeros(width, dtype=block.dtype)
    works = [dist.isend(block[:width].contiguous(), left_peer), dist.isend(block[-width:].contiguous(), right_peer),
             dist.irecv(right, right_peer), dist.irecv(left, left_peer)]
    halo_exchange.pending = works  # (kept alive, but never waited for)
    return left, right
    ### END SOLUTION
