    opt.zero_grad(set_to_none=True)
    out = model(x)
    loss = F.cross_entropy(out, y)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    opt.step()
    acc = (out.argmax(dim=1) == y).float().mean()
    # Wrong: no reads, but the logged loss keeps its step's autograd graph alive.
    history.append({"loss": loss, "grad_norm": grad_norm, "acc": acc})
