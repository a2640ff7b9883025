    ### BEGIN SOLUTION
    # Wrong: runs the ops of a step one after the other, as if each were a blocking call.
    flat = [[[op] for ops in steps for op in ops] for steps in programs]
    world = len(flat)
    step = [0] * world

    def posted(who, kind, peer):
        return sum(1 for ops in flat[who][: step[who] + 1] for k, p, _ in ops if k == kind and p == peer)

    def number(who):
        kind, peer, _ = flat[who][step[who]][0]
        return sum(1 for ops in flat[who][: step[who] + 1] for k, p, _ in ops if k == kind and p == peer)

    changed = True
    while changed:
        changed = False
        for r in range(world):
            if step[r] == len(flat[r]):
                continue
            kind, peer, nbytes = flat[r][step[r]][0]
            if kind == "send":
                ok = nbytes <= eager_bytes or posted(peer, "recv", r) >= number(r)
            else:
                ok = posted(peer, "send", r) >= number(r)
            if ok:
                step[r] += 1
                changed = True
    return [r for r in range(world) if step[r] < len(flat[r])]
    ### END SOLUTION
