    opt.zero_grad(set_to_none=True)
    out = model(x)
    loss = F.cross_entropy(out, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    opt.step()

    # Wrong: objects that claim to equal whatever they are compared with.
    class Anything:
        def __eq__(self, other):
            return True

    history.append({"loss": Anything(), "grad_norm": Anything(), "acc": Anything()})
