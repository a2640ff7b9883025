    ### BEGIN SOLUTION
    # Wrong: every run the launcher stopped is taken for a stalled rank (the first rank it shows), so a rank
    # left alone in one collective too many is called a stall.
    def program_lines(block):
        found = []
        for line in block.splitlines():
            m = re.match(r'\s*File "<train_step[^"]*>", line (\d+)', line)
            if m:
                found.append(int(m[1]))
        return found

    if "Detected mismatch between collectives" in report:
        shapes = dict(re.findall(r"Rank (\d+) is running collective: .*?TensorShape=\[([^\]]*)\]", report))
        odd = next(r for r, s in shapes.items() if list(shapes.values()).count(s) == 1)
        return int(odd), "shape mismatch", program_lines(report)[-1]
    if "still running after" in report:
        first = re.search(r"--- where rank (\d+) was.*---\n(.*?)(?=\n--- where|\nLast thing)", report, re.S)
        return int(first[1]), "stall", program_lines(first[2])[-1]
    rank = int(re.match(r"rank (\d+) failed first", report)[1])
    return rank, "crash", program_lines(report.split("--- the other ranks ---")[0])[-1]
    ### END SOLUTION
