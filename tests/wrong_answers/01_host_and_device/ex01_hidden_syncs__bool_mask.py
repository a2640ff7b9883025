    opt.zero_grad(set_to_none=True)
    out = model(x)
    # Wrong: dropping "ignored" labels with a boolean mask gives a data-dependent shape (a sync).
    keep = y >= 0
    loss = F.cross_entropy(out[keep], y[keep])
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    opt.step()
    acc = (out.argmax(dim=1) == y).float().mean()
    history.append({"loss": loss.detach(), "grad_norm": grad_norm, "acc": acc})
