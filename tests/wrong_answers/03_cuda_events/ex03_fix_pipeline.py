    # Wrong: keeps y alive for the consumer, but nothing orders the consumer after the producer.
    producer.wait_stream(torch.cuda.current_stream())
    outs = []
    for x in chunks:
        with torch.cuda.stream(producer):
            y = produce(x, stage_ms)
        y.record_stream(consumer)
        with torch.cuda.stream(consumer):
            outs.append(consume(y, stage_ms))
    torch.cuda.current_stream().wait_stream(consumer)
    return outs
