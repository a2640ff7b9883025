    ### BEGIN SOLUTION
    # Wrong: every rank sends first with blocking calls (ring order), so every send waits for a receive that
    # its neighbour posts only after its own sends: a deadlock on gloo at any size.
    rank, world = dist.get_rank(), dist.get_world_size()
    left_peer, right_peer = (rank - 1) % world, (rank + 1) % world
    left = torch.empty(width, dtype=block.dtype)
    right = torch.empty(width, dtype=block.dtype)
    dist.send(block[-width:].contiguous(), right_peer)
    dist.send(block[:width].contiguous(), left_peer)
    dist.recv(left, left_peer)
    dist.recv(right, right_peer)
    return left, right
    ### END SOLUTION
