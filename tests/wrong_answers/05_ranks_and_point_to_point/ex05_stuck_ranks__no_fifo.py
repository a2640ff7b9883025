    ### BEGIN SOLUTION
    # Wrong: a receive completes as soon as its peer has posted any send to it (messages are not counted).
    world = len(programs)
    step = [0] * world
    done = [set() for _ in range(world)]

    def posted(who, kind, peer):
        steps = programs[who][: step[who] + 1]
        return sum(1 for ops in steps for k, p, _ in ops if k == kind and p == peer)

    changed = True
    while changed:
        changed = False
        for r in range(world):
            if step[r] == len(programs[r]):
                continue
            ops = programs[r][step[r]]
            for i, (kind, peer, nbytes) in enumerate(ops):
                if i in done[r]:
                    continue
                if kind == "send":
                    ok = nbytes <= eager_bytes or posted(peer, "recv", r) >= 1
                else:
                    ok = posted(peer, "send", r) >= 1
                if ok:
                    done[r].add(i)
                    changed = True
            if len(done[r]) == len(ops):
                step[r], done[r], changed = step[r] + 1, set(), True
    return [r for r in range(world) if step[r] < len(programs[r])]
    ### END SOLUTION
