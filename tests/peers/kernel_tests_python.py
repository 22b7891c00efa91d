"""A complete jupyter_kernel_test suite for a Python kernel, every optional sample filled in.

This file is a peer suite, not one of ours: tests/peers/test_peer_suites.py runs it with
pytest twice, once with the kernelspec `python3` pointing at plain ipykernel and once at the
sandbox kernel, and compares. The samples are what a real IPython kernel answers, so each
test passes on ipykernel (the harness checks that too).
"""

from __future__ import annotations

# The module, not its classes: a class imported by name here would be collected and run too.
import jupyter_kernel_test as jkt


class PythonKernelTests(jkt.KernelTests):
    kernel_name = "python3"
    language_name = "python"
    file_extension = ".py"

    code_hello_world = "print('hello, world')"
    code_stderr = "import sys; print('oops', file=sys.stderr)"

    completion_samples = [
        {"text": "zi", "matches": {"zip"}},
        {"text": "import collecti", "matches": {"collections"}},
        {"text": "str.isdig", "matches": {"isdigit"}},  # IPython completes the attribute alone
    ]
    complete_code_samples = ["1", "print('hello, world')", "def f(x):\n    return x\n\n", "%ls", "!ls"]
    incomplete_code_samples = ["print('''hello", "def f(x):", "for i in range(3):", "x = ("]
    invalid_code_samples = ["import = 7q", "1 +* 2", "return 1)"]

    code_page_something = "zip?"
    code_generate_error = "raise ValueError('boom')"

    code_execute_result = [
        {"code": "1 + 2 + 3", "result": "6"},
        {"code": "'hello' * 2", "result": "'hellohello'"},
        {"code": "from IPython.display import HTML; HTML('<b>bold</b>')",
         "mime": "text/html", "result": "<b>bold</b>"},
        {"code": "[n * n for n in range(4)]", "result": "[0, 1, 4, 9]"},
    ]
    code_display_data = [
        {"code": "from IPython.display import HTML, display; display(HTML('<b>x</b>'))",
         "mime": "text/html"},
        {"code": "from IPython.display import Math, display; display(Math(r'\\alpha'))",
         "mime": "text/latex"},
        {"code": "from IPython.display import JSON, display; display(JSON({'a': 1}))",
         "mime": "application/json"},
    ]
    # Matches one of the code_execute_result samples, as the base class asks.
    code_history_pattern = "1 + 2*"
    # Not "range": ipykernel answers a range request for the session number that a tail reply
    # gave with session 0 ("this session"), which jupyter_kernel_test's range check rejects.
    supported_history_operations = ("tail", "search")

    code_inspect_sample = "zip"
    code_clear_output = "from IPython.display import clear_output; print('x'); clear_output()"


class PythonIopubWelcomeTests(jkt.IopubWelcomeTests):
    kernel_name = "python3"
    # ipykernel 7 publishes on an XPUB socket and welcomes each subscriber (JEP 65).
    support_iopub_welcome = True
