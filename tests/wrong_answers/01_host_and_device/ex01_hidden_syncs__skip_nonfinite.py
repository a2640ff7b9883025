    opt.zero_grad(set_to_none=True)
    out = model(x)
    loss = F.cross_entropy(out, y)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    # Wrong: `if tensor:` needs the value on the host to choose the branch.
    if torch.isfinite(grad_norm):
        opt.step()
    acc = (out.argmax(dim=1) == y).float().mean()
    history.append({"loss": loss.detach(), "grad_norm": grad_norm, "acc": acc})
