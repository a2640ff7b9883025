    ### BEGIN SOLUTION
    # Wrong: a hang anywhere is reported as every rank stuck.
    world = len(programs)
    step = [0] * world
    done = [set() for _ in range(world)]

    def posted(who, kind, peer):
        steps = programs[who][: step[who] + 1]
        return sum(1 for ops in steps for k, p, _ in ops if k == kind and p == peer)

    def number(who, i):
        kind, peer, _ = programs[who][step[who]][i]
        earlier = [op for ops in programs[who][: step[who]] for op in ops] + programs[who][step[who]][: i + 1]
        return sum(1 for k, p, _ in earlier if k == kind and p == peer)

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
                    ok = nbytes <= eager_bytes or posted(peer, "recv", r) >= number(r, i)
                else:
                    ok = posted(peer, "send", r) >= number(r, i)
                if ok:
                    done[r].add(i)
                    changed = True
            if len(done[r]) == len(ops):
                step[r], done[r], changed = step[r] + 1, set(), True
    stuck = [r for r in range(world) if step[r] < len(programs[r])]
    return list(range(world)) if stuck else []
    ### END SOLUTION
