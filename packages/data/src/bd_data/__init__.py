"""bd_data: tokenizers, verifiable tasks, the block-aligned canvas, masking corruption and grain pipelines.

Produces numpy `bd_core.DiffusionTokenBatch`es in the SFT layout and left-padded prompt batches
for rollouts. Tasks (`get_task(name, seed=..., **params)`, train/eval splits that share no prompt,
bounded-time rewards): sort, argsort, addition, addition_lsd; countdown, mini_sudoku, chain_sum
from reasoning-gym in compact prompts; math, the user's JSONL scored by math-verify. Chat models'
prompts go through their own chat template (`ChatTemplate`, `ChatSource`). Depends on
bd_core, numpy, grain, tokenizers, jinja2, reasoning-gym and math-verify.
"""

from ._bounded_verify import VerifyWorkerError as VerifyWorkerError
from ._bounded_verify import start_verify_worker as start_verify_worker
from ._bounded_verify import verify_math as verify_math
from ._canvas import Canvas as Canvas
from ._canvas import CanvasConfig as CanvasConfig
from ._canvas import CanvasOverflow as CanvasOverflow
from ._canvas import build_canvas as build_canvas
from ._canvas import fit_to_canvas as fit_to_canvas
from ._canvas import prompt_canvas as prompt_canvas
from ._chat import ChatSource as ChatSource
from ._chat import ChatTemplate as ChatTemplate
from ._chat import ChatTemplateError as ChatTemplateError
from ._chat import load_chat_template as load_chat_template
from ._corruption import DEFAULT_CORRUPTION as DEFAULT_CORRUPTION
from ._corruption import CorruptionConfig as CorruptionConfig
from ._corruption import corrupt as corrupt
from ._corruption import sample_t as sample_t
from ._example import Example as Example
from ._jsonl import JsonlError as JsonlError
from ._jsonl import JsonlSource as JsonlSource
from ._jsonl import OverlongReport as OverlongReport
from ._jsonl import load_jsonl as load_jsonl
from ._math_task import MathTask as MathTask
from ._pipeline import PromptBatch as PromptBatch
from ._pipeline import iterate as iterate
from ._pipeline import prompt_dataset as prompt_dataset
from ._pipeline import sft_dataset as sft_dataset
from ._rg_tasks import ChainSumTask as ChainSumTask
from ._rg_tasks import CountdownTask as CountdownTask
from ._rg_tasks import MiniSudokuTask as MiniSudokuTask
from ._rg_tasks import ReasoningGymTask as ReasoningGymTask
from ._safe_arith import ArithmeticRejected as ArithmeticRejected
from ._safe_arith import evaluate_arithmetic as evaluate_arithmetic
from ._task import PARTIAL_CREDIT as PARTIAL_CREDIT
from ._task import GeneratedTask as GeneratedTask
from ._task import Task as Task
from ._task import TaskSource as TaskSource
from ._tasks import DEFAULT_TASK as DEFAULT_TASK
from ._tasks import TASKS as TASKS
from ._tasks import AdditionLSDTask as AdditionLSDTask
from ._tasks import AdditionTask as AdditionTask
from ._tasks import ArgsortTask as ArgsortTask
from ._tasks import PatternTask as PatternTask
from ._tasks import SortTask as SortTask
from ._tasks import get_task as get_task
from ._tokenizer import ByteTokenizer as ByteTokenizer
from ._tokenizer import HFTokenizer as HFTokenizer
from ._tokenizer import Tokenizer as Tokenizer
from ._tokenizer import TokenizerError as TokenizerError
from ._tokenizer import special_tokens as special_tokens
from ._tokenizer import tokenizer_config as tokenizer_config

__version__ = "0.1.0"
