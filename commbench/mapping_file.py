"""Reading a user's JSON or YAML file that holds one mapping (model and plan
files, later system specs): every failure is a ValueError naming the file."""
import json


def load(path: str, what: str) -> dict:
    yaml_file = path.endswith((".yaml", ".yml"))
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"cannot read {what} file {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{what} file {path} is not UTF-8 text") from None
    try:
        if yaml_file:
            import yaml
            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception:
        raise ValueError(f"{what} file {path} is not valid {'YAML' if yaml_file else 'JSON'}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what} file {path}: expected a mapping of fields, got {type(data).__name__}")
    return data
