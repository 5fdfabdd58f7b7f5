"""A pytest plugin for nbval's run of a lesson (tests/test_notebooks.py, ``-p nbval_record``):
``--record-executed PATH`` also writes the lesson as executed to PATH, once every cell has passed.

nbval runs the cells in its kernel and checks them; this plugin only listens. Every message the
kernel sends about a cell goes, as nbval reads it, to nbclient's own message handling, the one
Jupyter Book's and `make book`'s executor uses: so the record holds the outputs, display updates,
cleared outputs, execution counts and widget state that executor would. The book tests build from
these records (conftest's lesson_executions) instead of executing every lesson a second time."""
import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionComplete


def pytest_addoption(parser):
    parser.addoption("--record-executed", metavar="PATH",
                     help="write the notebook nbval runs, with its outputs, to PATH")


def pytest_configure(config):
    path = config.getoption("--record-executed")
    if path:
        config.pluginmanager.register(Recorder(path), "nbval-recorder")


class Recorder:
    def __init__(self, path):
        self.path, self.notebook, self.client, self.request_id = path, None, None, None
        self.cell_index, self.recorded = None, set()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item):
        if self.client is None:  # the first cell: nbval has started its kernel
            self.listen(item.parent)
        self.cell_index = self.code_cells[item.cell_num]
        self.client.clear_before_next_output = False  # as nbclient starts each cell
        outcome = yield
        if outcome.excinfo is None:  # run and passed (not skipped)
            self.recorded.add(item.cell_num)
            self.number(self.notebook.cells[self.cell_index])

    def number(self, cell):
        """Number the cell in the order the cells ran, as a notebook's executor does (nbval runs
        each without storing history, so the kernel's own count stays at 1)."""
        cell.execution_count = len(self.recorded)
        for output in cell.outputs:
            if output.output_type == "execute_result":
                output.execution_count = cell.execution_count

    def listen(self, nbval_file):
        """Follow nbval's kernel: note each cell's request, and pass the messages about it on."""
        self.notebook = nbformat.read(str(nbval_file.fspath), as_version=4)
        self.code_cells = [i for i, cell in enumerate(self.notebook.cells)
                           if cell.cell_type == "code"]
        kernel = nbval_file.kernel
        self.client = NotebookClient(self.notebook, kc=kernel.kc, record_timing=False)
        self.client.reset_execution_trackers()
        info = kernel.kc.kernel_info(reply=True, timeout=60)["content"]
        self.notebook.metadata["language_info"] = info["language_info"]
        execute, get_message = kernel.execute_cell_input, kernel.get_message

        def execute_cell_input(source, allow_stdin=None):
            self.request_id = execute(source, allow_stdin=allow_stdin)
            return self.request_id

        def get_message_and_record(stream, timeout=None):
            message = get_message(stream, timeout=timeout)
            if stream == "iopub" and message["parent_header"].get("msg_id") == self.request_id:
                self.record(message)
            return message

        kernel.execute_cell_input, kernel.get_message = execute_cell_input, get_message_and_record

    def record(self, message):
        try:
            self.client.process_message(message, self.notebook.cells[self.cell_index],
                                        self.cell_index)
        except CellExecutionComplete:  # the cell's last message: nbval stops reading too
            pass

    def pytest_sessionfinish(self, session):
        """Write the record only when nbval ran and passed every code cell."""
        if self.notebook is None or session.testsfailed or \
                len(self.recorded) != len(self.code_cells):
            return
        self.client.set_widgets_metadata()
        nbformat.write(self.notebook, self.path)
