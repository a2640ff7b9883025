    ### BEGIN SOLUTION
    # Wrong: every step on its own stream, so the steps of one chain run at the same time.
    main = torch.cuda.current_stream()
    streams = []
    for chain in chains:
        for step in chain:
            stream = torch.cuda.Stream()
            stream.wait_stream(main)
            with torch.cuda.stream(stream):
                step()
            streams.append(stream)
    for stream in streams:
        main.wait_stream(stream)
    ### END SOLUTION
