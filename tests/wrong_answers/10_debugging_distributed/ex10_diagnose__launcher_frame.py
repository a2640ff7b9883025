    ### BEGIN SOLUTION
    # Wrong: the right rank and fault, but the line of the first frame of the traceback or stack (the check's
    # runner), not the program's.
    def first_line(block):
        m = re.search(r'File "[^"]*", line (\d+)', block)
        return int(m[1]) if m else 0

    if "Detected mismatch between collectives" in report:
        shapes = dict(re.findall(r"Rank (\d+) is running collective: .*?TensorShape=\[([^\]]*)\]", report))
        odd = next(r for r, s in shapes.items() if list(shapes.values()).count(s) == 1)
        return int(odd), "shape mismatch", first_line(report)
    if "still running after" in report:
        stacks = re.split(r"--- where rank (\d+) was.*---\n", report.split("Last thing each rank printed")[0])[1:]
        where = {int(r): s for r, s in zip(stacks[::2], stacks[1::2])}
        for rank, stack in where.items():
            if "time.sleep" in stack:
                return rank, "stall", first_line(stack)
        rank = next(iter(where))
        return rank, "extra collective", first_line(where[rank])
    rank = int(re.match(r"rank (\d+) failed first", report)[1])
    return rank, "crash", first_line(report)
    ### END SOLUTION
