    ### BEGIN SOLUTION
    # Wrong: every run the launcher stopped is taken for a stalled rank, so a rank left alone in one collective
    # too many is called a stall (a real stall is found right: the rank that is not in a collective).
    def program_lines(block):
        found, lines = [], block.splitlines()
        for i, line in enumerate(lines):
            m = re.match(r'\s*File "<train_step[^"]*>", line (\d+)', line)
            if m:
                found.append((int(m[1]), lines[i + 1].strip() if i + 1 < len(lines) else ""))
        return found

    if "Detected mismatch between collectives" in report:
        shapes = dict(re.findall(r"Rank (\d+) is running collective: .*?TensorShape=\[([^\]]*)\]", report))
        odd = next(r for r, s in shapes.items() if list(shapes.values()).count(s) == 1)
        return int(odd), "shape mismatch", program_lines(report)[-1][0]
    if "still running after" in report:
        stacks = re.split(r"--- where rank (\d+) was.*---\n", report.split("Last thing each rank printed")[0])[1:]
        where = {int(r): program_lines(s)[-1] for r, s in zip(stacks[::2], stacks[1::2])}
        rank = next((r for r, (_, source) in where.items() if not source.startswith("dist.")), next(iter(where)))
        return rank, "stall", where[rank][0]
    rank = int(re.match(r"rank (\d+) failed first", report)[1])
    return rank, "crash", program_lines(report.split("--- the other ranks ---")[0])[-1][0]
    ### END SOLUTION
