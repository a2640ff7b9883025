    ### BEGIN SOLUTION
    # Wrong: overlapped and correct, but the host waits for the whole GPU instead of the current stream waiting.
    main = torch.cuda.current_stream()
    streams = [torch.cuda.Stream() for _ in chains]
    for stream, chain in zip(streams, chains, strict=True):
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            for step in chain:
                step()
    torch.cuda.synchronize()
    ### END SOLUTION
