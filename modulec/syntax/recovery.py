def parse_with_recovery(p, source, text):
    p.parse_raw(text, source.name)
